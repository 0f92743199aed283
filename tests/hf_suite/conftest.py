# test_tagclip_hf_common.py only runs inside the scratch tree built by setup_suite.py (it imports transformers'
# upstream test mixins relatively); tests/models/test_hf_common_suite.py drives it from the project's suite.
collect_ignore = ["test_tagclip_hf_common.py"]
