"""From a trained folder to answers: encoding, TAG-PR Eq. 14 scoring, the gallery index, the `tagclip` CLI, pipeline, handler."""
