"""Sequence classification: GLUE-style TSV/CSV files, scored by accuracy and macro-F1
(`tasks.seqcls.task.SEQ_CLS`; the files, the generated review task and the data of a run in
`tasks.seqcls.data`)."""
