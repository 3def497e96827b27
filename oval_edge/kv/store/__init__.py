"""The disk tier under the page pool ([R-kinds-and-tiers]): the page file on the NVMe drive (page_file.py), the pool's
side of it, spilling and recalling pages (tier.py), and what it counts for /metrics (stats.py)."""
