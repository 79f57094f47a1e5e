"""One small framework for polyfhe's child processes: Concrete ML's workers, Lattigo's key child, the server's
workers.

Two halves. The child's half (:mod:`.framing`, :mod:`.limits`, :mod:`.stamp`, :mod:`.child_main`) imports the
standard library only, and its modules import each other relatively, so a child running in an environment of its
own, where polyfhe is not installed (Concrete ML's), loads them by path under a private package name
(``polyfhe/engines/concrete/worker_main.py`` shows how). The parent's half (:mod:`.child`, :mod:`.watchdog`,
:mod:`.environments`) starts and watches children and lists the environments ``polyfhe setup`` builds.

This ``__init__`` imports nothing: it is the package a child loads by path.
"""
