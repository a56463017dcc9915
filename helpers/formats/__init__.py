"""Readers and writers of files other tools write or this tool keeps: draft / target configs (:mod:`.configs`),
training data of SpecForge, speculators and EAGLE (:mod:`.training_data`), and the dump format plus SGLang answers and
dumper files (:mod:`.dumps`). Bad input raises :class:`helpers.errors.BadInput` naming the file and field; ``.pt``
files load only with ``weights_only=True``."""
