# Sourced by the GPU run scripts: one background job per machine that outlives the device call
# which started it (a later call on the same hold can wait for it; a machine given back loses it).
#   rb_start DIR "COMMANDS"   runs COMMANDS detached, its output in DIR/run.log, DIR/finished at the end
#   rb_wait DIR               waits for DIR/finished until WAIT_S seconds (default 540) after the sourcing
#                             script started — the device call's clock, install time included (2026-11-28: a
#                             wait counted from after FA4's 45-s install ran the call past its 600-s limit,
#                             killed before it could pack its files)
rb_start() {
  rm -f "$1/finished"  # a finished mark left by an earlier run would end the wait at once
  date > "$1/started"
  setsid nohup bash -c "$2 date > $1/finished" > "$1/run.log" 2>&1 < /dev/null &
}
rb_wait() {
  local end=${WAIT_S:-540}  # bash's SECONDS counts from the script's start
  while [ ! -e "$1/finished" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  if [ -e "$1/finished" ]; then echo FINISHED; else echo "STILL RUNNING"; fi
}
