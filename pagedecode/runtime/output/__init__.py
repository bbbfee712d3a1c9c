"""The output side: from a selected token to what a reader sees. The pipeline (detokenizer and
stop matching) turns tokens into text deltas, the events carry them, delivery appends them to the
request's history and serves its readers, and a finished request's history and result are kept
compactly."""
