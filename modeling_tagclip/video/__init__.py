"""From footage to a gallery (``tagclip ingest``): frames, the camera file, detection, tracking, crops and the
gallery they go into; see docs/video.md."""
