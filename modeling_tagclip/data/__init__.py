"""Files to datasets: text-retrieval loaders, re-ID loaders, the embedded synthetic sets."""
