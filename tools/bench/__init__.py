"""`oval-edge bench`: speed and memory of OVAL vs dense and the peers, one child process per run."""
