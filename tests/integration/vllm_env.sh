#!/usr/bin/env bash
# The real-vLLM engine venv installer lives next to its launcher: engines/vllm_env.sh (see there
# for what it does, its environment and its exit statuses). This path, where it used to live,
# keeps working for people and scripts that know it.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../engines/vllm_env.sh" "$@"
