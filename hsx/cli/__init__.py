"""The ``hsx`` command: the composition root, which may import every layer, app and workers included.
Its client commands (submit, watch, export, feed) need ``hsx[cli]``; api, worker, engine and db need the
server and worker extras."""
