"""The stdlib Q&A multiple-choice task (``tasks=[stdlib_qa]``)."""
