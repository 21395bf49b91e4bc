"""The programs built on the library: the CLI, ``serve``, ``demo``, ``replay``, ``bench``.

They sit on top of everything else and nothing imports them back.
"""
