# Sourced by the scripts that build a tool from the Go module proxy into the cache
# (tests/e2e/build-helm.sh, tests/e2e/build-runc.sh, bench/build-kwok.sh). Each sets CACHE
# and OUT and defines `cached` (whether OUT holds the build asked for) and `build`, then
# calls `go_tool NAME RESULT WANTED`: RESULT is printed once OUT holds the build, made first when
# it does not. One build at a time (a lock in the cache: two runs never build into one
# directory, and the second uses the first's), and a build that does not pass `cached` is
# an error that names WANTED.

go_tool() {
    local name=$1 result=$2 wanted=$3
    if ! cached; then
        command -v go >/dev/null || { echo "build-$name: needs Go and the Go module proxy" >&2; exit 1; }
        mkdir -p "$CACHE"
        exec 9>"$CACHE/.build-$name.lock"
        flock 9
        if ! cached; then
            build
            cached || { echo "build-$name: $OUT does not hold $wanted" >&2; exit 1; }
        fi
    fi
    echo "$result"
}
