#!/usr/bin/env bash
# test_resume_lora.sh — exact resume of a LoRA run: tests/test_resume.sh with examples/sft.lua --lora 4 (12 updates
# in one process == 5 updates, a checkpoint holding the adapters beside the frozen weights, a NEW process and 7
# more: the losses, the adapters and their AdamW moments bit-identical).
#   bash tests/test_resume_lora.sh <path-to-ds4> <fixtures_dir> <source_dir>
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$here/test_resume.sh" "$@" --lora 4
