"""With this folder on PYTHONPATH and LOWMEM_TEST_CONSTRUCTIONS set, every Python process started (a process that
replaces itself with a fresh one too) records its constructions there (tests/constructions.py)."""

import os

if os.environ.get("LOWMEM_TEST_CONSTRUCTIONS"):
    import constructions

    constructions.install(os.environ["LOWMEM_TEST_CONSTRUCTIONS"])
