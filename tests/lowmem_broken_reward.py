"""A reward module that raises while it is imported (not an ImportError), for tests/test_bad_input.py."""

raise RuntimeError("boom: this reward module cannot be imported")


def score(completions, **kwargs):  # never reached
    return [0.0] * len(completions)
