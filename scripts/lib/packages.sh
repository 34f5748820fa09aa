# Sourced by scripts/*.sh. `ensure_packages WHAT:PACKAGE ...` installs, with
# apt-get, the Debian PACKAGE of every WHAT that is missing: WHAT is a
# command name, or an absolute path to a file (a header, a library).
ensure_packages() {
  local need=() entry what package
  for entry in "$@"; do
    what="${entry%%:*}"
    package="${entry#*:}"
    if [[ "$what" == /* ]]; then
      [ -e "$what" ] || need+=("$package")
    else
      command -v "$what" >/dev/null || need+=("$package")
    fi
  done
  [ ${#need[@]} -gt 0 ] || return 0
  echo "$(basename "$0"): installing ${need[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
}
