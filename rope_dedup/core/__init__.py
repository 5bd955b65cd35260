"""The sharing core: the canonical store, the rules that decide what may share, the report, memory and
reload safety. What both the compile path and ``share()`` stand on; it imports nothing above it."""
