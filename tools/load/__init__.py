"""`oval-edge bench --serve`: concurrent streaming clients against `oval-edge serve`, and what they conclude."""
