#!/usr/bin/env bash
# An importable copy of slothkit at a git revision, for comparing two versions in one
# benchmark run (the run-to-run spread on a GPU is larger than many changes' effect):
#
#   bash scripts/ab_tree.sh 628f7c6     # writes .ab/628f7c6/{slothkit,slothkit_kernels,slothkit_templates}
#   slothkit bench train --model llama-3-8b --impl slothkit,slothkit@.ab/628f7c6,hf
#
# On a GPU machine, bring .ab/REV along with the checkout (a few hundred KB;
# .ab/ is git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/ab_tree.sh REV}
out=.ab/$rev
rm -rf "$out"
mkdir -p "$out"
# The kernel library's folder: slothkit_kernels/, or kernels/ in a revision whose
# pyproject.toml installs that folder as slothkit_kernels.
if git cat-file -e "$rev:slothkit_kernels" 2>/dev/null; then kernels=slothkit_kernels; else kernels=kernels; fi
git archive "$rev" slothkit "$kernels" templates | tar -x -C "$out"
if [ "$kernels" != slothkit_kernels ]; then mv "$out/$kernels" "$out/slothkit_kernels"; fi
# The package name pyproject.toml gives templates/.
mv "$out/templates" "$out/slothkit_templates"
echo "$out"
