"""A sealed page's records (the OVAL record: mean, basis, coordinates; the coarse group record of two-level
scoring and its slots) and how pages are summarised into them when they seal."""
