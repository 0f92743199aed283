"""From a trained folder to answers: encoding, Eq. 14 scoring, the gallery index, the `tagclip` CLI, pipeline, handler."""
