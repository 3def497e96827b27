"""`oval-edge pull`: a model from the Hugging Face Hub into its cache, checked against `plan` first."""
