"""`make board-check`: the Jetson's Python installs resolved on any machine with PyPI in reach.

The serve-only board install (torch provided by JetPack) and the L4T image's pip steps are resolved for an Orin on
JetPack 6 (aarch64, CPython 3.10, glibc 2.35) with pip's own resolver and PyPI's metadata, markers evaluated for
that machine: every package must come as a real aarch64 / cp310 wheel and no dependency may ask for a torch other
than the board's. `python -m oval_edge.tools.board_check --help` lists the options.
"""
