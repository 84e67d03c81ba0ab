# The environments the test command builds (sourced by test.sh, demo.sh and lock.sh; one place to change them).
# Each: a virtualenv folder, the hf_gradfix extras, extra pip requirements, and its lock file (pip constraints).
# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this file
TF5_VENV=.venv
TF5_EXTRAS=dev
TF5_ARGS=()
TF5_LOCK=requirements/lock-tf5.txt
TF457_VENV=.venv-tf457
TF457_EXTRAS=peft
TF457_ARGS=("transformers>=4.57,<4.58" "pytest>=8" "datasets>=3")
TF457_LOCK=requirements/lock-tf457.txt
