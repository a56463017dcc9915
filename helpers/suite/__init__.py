"""The notebook suite: its params file (:mod:`.params`), the batch runner (papermill into a new run folder,
:mod:`.runner`) and the offline HTML pages (:mod:`.html`)."""
