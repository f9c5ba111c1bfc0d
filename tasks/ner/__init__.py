"""Token classification: NER on CoNLL files, scored by entity-level F1 (`tasks.ner.task.NER`; the
data of a run in `tasks.ner.data`)."""
