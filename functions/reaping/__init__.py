"""The one reaping sequence every target runs (docs/architecture.md, "How a deletion is
made safe"): prove -> scope -> read -> judge -> admit -> remove held to a precondition the
store enforces -> conclude. `sequence.py` is the sequence, `ports.py` what a target
supplies, `ends.py` where it ends, `failures.py` the one failure hierarchy the edges map
their libraries' errors into."""
