"""The wire contract: what a message on the broker means, in any language.

* :mod:`.wire`: message types, headers, queue and exchange names, and the messages an event
  implies (docs/wire-format.md is its prose);
* :mod:`.intake`: what a delivery may be before the worker acts on it (its shape, its size, its
  metadata), and the rejection a message that is not gets.

No broker or database driver is imported here.
"""
