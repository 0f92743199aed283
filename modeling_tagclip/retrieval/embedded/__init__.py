"""The embedded gallery index: on-disk format, commits, compaction, the faiss ANN, the build and search."""
