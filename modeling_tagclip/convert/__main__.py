"""`python -m modeling_tagclip.convert hf-clip|tagpr ...` (TAG-CLIP); ViSA: `python -m modeling_tagclip.convert.visa`."""

from .tagclip import main

if __name__ == "__main__":
    main()
