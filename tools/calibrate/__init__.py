"""`oval-edge calibrate`: fit the output-aware window module and freeze the oval scorer's eta and rank on the
model's own dense attention."""
