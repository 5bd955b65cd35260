"""What rides on the library: the ``rope-dedup`` command line, the memory profile, its plot, model factories."""
