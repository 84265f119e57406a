"""bench_real_model.py's setups: their letters, and which of them draft locally, through the service, in the match
mode, or alone."""

SETUPS = ("a", "b", "c", "d", "e", "f", "g", "h")
LOCAL = ("c", "e", "g", "h")  # a local Drafter per worker, merged after each request: (c) compatible, (e) match
SERVICE = ("d", "f")  # an NgramClient per worker: (d) compatible, (f) match
MATCH = {"e": "c", "f": "d", "h": "g"}  # a match-mode setup -> its compatible-mode counterpart
SOLO = "d-alone"  # worker B drafting through a namespace without A's counts
