"""Adapters: the only code that imports pyzmq, NIXL, torch or vLLM.

This folder is installed as the import package ``p2pactor.adapters``. Each
adapter implements a small interface defined by the runtime, so the runtime can
be tested with in-memory fakes and with the real thing.
"""
