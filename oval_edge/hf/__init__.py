"""The Hugging Face integration: `apply_oval_to_model` (model.generate() decodes with OVAL through transformers'
attention and cache interfaces), its paged cache and the eval hook built on it."""
