"""Jinja model-card templates (``*.md``), installed as ``hf_triaccel.model_card_templates``."""
