#!/usr/bin/env bash
# Checks commit messages: a subject of at most 72 characters, a blank line, then a body.
#   scripts/check_commits.sh                      every commit since this check was added (CI)
#   scripts/check_commits.sh --message-file FILE  one message (the commit-msg hook,
#                                                 scripts/hooks/commit-msg)
# The commits checked are the one that added this script and every commit descending from it
# (git rev-list --ancestry-path): older history, and commits of branches forked before it and
# merged since, are not rewritten for it. Merge commits are skipped (git writes their messages).
set -euo pipefail
export LC_ALL=C.UTF-8  # count characters, not bytes
readonly max_subject=72

# Prints what is wrong with the message on stdin (nothing when it is fine). Comment lines and
# everything below git's scissors line (commit --verbose) are not part of a message.
problems() {
  local lines=() line
  while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" == "# ------------------------ >8 ------------------------"* ]] && break
    [[ "$line" == "#"* ]] && continue
    lines+=("$line")
  done
  while [[ ${#lines[@]} -gt 0 && -z "${lines[-1]// /}" ]]; do unset 'lines[-1]'; done
  local subject="${lines[0]:-}"
  if [[ -z "${subject// /}" ]]; then
    echo "the subject (first line) is empty"
    return
  fi
  if [[ ${#subject} -gt $max_subject ]]; then
    echo "the subject has ${#subject} characters; at most $max_subject: say what changed, and" \
      "put the details in the body"
  fi
  if [[ ${#lines[@]} -lt 3 ]]; then
    echo "there is no body: after the subject, a blank line, then what changed and why"
  elif [[ -n "${lines[1]// /}" ]]; then
    echo "the second line is not blank: separate the subject from the body with a blank line"
  fi
}

if [[ "${1:-}" == "--message-file" ]]; then
  [[ -f "${2:-}" ]] || { echo "check_commits: --message-file needs a file" >&2; exit 2; }
  found=$(problems < "$2")
  if [[ -n "$found" ]]; then
    echo "commit message refused:" >&2
    sed 's/^/  /' <<< "$found" >&2
    echo "(the message was kept in ${2}; git commit -e -F ${2} edits it again)" >&2
    exit 1
  fi
  exit 0
fi

cd "$(dirname "$0")/.."
start=$(git log --diff-filter=A --format=%H -- scripts/check_commits.sh | tail -n 1)
if [[ -z "$start" ]]; then
  # Not committed yet, or a shallow clone that stops after it: the newest commit only.
  echo "check_commits: the commit that added this check is not in this history; checking HEAD"
  commits=("$(git rev-parse HEAD)")
else
  mapfile -t commits < <(git rev-list --no-merges --ancestry-path "$start..HEAD")
  commits+=("$start")
fi
bad=0
for commit in "${commits[@]}"; do
  [[ $(git rev-list --no-walk --count --no-merges "$commit") -eq 1 ]] || continue
  found=$(git log -1 --format=%B "$commit" | problems)
  if [[ -n "$found" ]]; then
    echo "check_commits: $(git log -1 --format='%h %s' "$commit")" >&2
    sed 's/^/  /' <<< "$found" >&2
    bad=$((bad + 1))
  fi
done
if [[ $bad -gt 0 ]]; then
  echo "check_commits: $bad of ${#commits[@]} commit(s) need a better message" \
    "(git rebase -i, 'reword'); scripts/hooks/commit-msg checks them as you commit" >&2
  exit 1
fi
echo "check_commits: ${#commits[@]} commit(s) since ${start:0:12} have a subject of at most" \
  "$max_subject characters and a body"
