"""``tagclip search``: its flags and its run are the gallery commands' (``modeling_tagclip.retrieval.cli``)."""

from modeling_tagclip.retrieval.cli import add_search_arguments as add_arguments
from modeling_tagclip.retrieval.cli import run

__all__ = ["add_arguments", "run"]
