"""Hub publishing: model cards (templates in `cards/`, shipped with the package) and `push_to_hub`."""
