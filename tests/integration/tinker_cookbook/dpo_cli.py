"""The command line tinker-cookbook 0.6.1 lacks for its DPO trainer, built the way its own
trainers' `__main__` are (`supervised/train.py`: `chz.nested_entrypoint(main)`).

`recipes/preference/dpo/train.py` accepts only hub dataset names (hhh, helpsteer3,
ultrafeedback); `preference/train_dpo.py` has no `__main__`. This runs the unmodified
`train_dpo.main` on a `train_dpo.Config` made from chz overrides on the command line, so any
builder the cookbook ships can be named there, e.g. a local JSONL file of labeled comparisons:

    python dpo_cli.py model_name=... log_path=... recipe_name=... (one command line)
      dataset_builder=tinker_cookbook.preference.dpo_datasets:DPODatasetBuilderFromComparisons
      dataset_builder.comparison_builder=
        tinker_cookbook.preference.preference_datasets:ComparisonBuilderFromJsonl
      dataset_builder.comparison_builder.train_path=prefs.jsonl ...
"""

import chz
from tinker_cookbook.preference import train_dpo

if __name__ == "__main__":
    chz.nested_entrypoint(train_dpo.main, allow_hyphens=True)
