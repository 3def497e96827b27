"""`oval-edge plan`: a budget, page size and context for a Jetson Orin module (or this host), without torch."""
