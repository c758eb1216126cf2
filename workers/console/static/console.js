// Waystation console: the only script. It refreshes the element marked data-refresh="N" every
// N seconds from the same page, rendered (and escaped) by the server, and asks for a
// confirmation where a button says data-confirm. Nothing else; every page works without it.
"use strict";
(function () {
  const live = document.querySelector("[data-refresh]");
  if (live && live.id) {
    const seconds = Math.max(2, parseInt(live.dataset.refresh, 10) || 5);
    const refresh = async function () {
      try {
        const response = await fetch(window.location.href, {headers: {"Accept": "text/html"}});
        if (response.ok) {
          const page = new DOMParser().parseFromString(await response.text(), "text/html");
          const fresh = page.getElementById(live.id);
          if (fresh) live.replaceChildren(...fresh.childNodes);
        }
      } catch (error) { /* the next round tries again */ }
      window.setTimeout(refresh, seconds * 1000);
    };
    window.setTimeout(refresh, seconds * 1000);
  }
  document.addEventListener("submit", function (event) {
    const button = event.submitter;
    const question = button && button.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });
})();
