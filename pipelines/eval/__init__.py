"""Evaluation: the agentic runner (`runner`), lmms-eval interoperability (`lmms`, `lmms_plugin`)."""
