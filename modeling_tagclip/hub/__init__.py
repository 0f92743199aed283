"""Hub publishing: one stage → card → push path (`push_to_hub`) with a per-family adapter (`family`, `tagclip`,
`visa`); run files (`run_files`), example crops (`examples`), card rendering (`card`, templates in `cards/`)."""
