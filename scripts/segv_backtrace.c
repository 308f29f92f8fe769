/* Diagnostics (the GPU machine has no gdb): LD_PRELOAD this to print the native stack of a
 * crash, e.g. scripts/aoti_probe.py's under AOTInductor.
 *   gcc -shared -fPIC -O0 -o /tmp/segv_backtrace.so scripts/segv_backtrace.c -ldl
 *   LD_PRELOAD=/tmp/segv_backtrace.so python3 scripts/aoti_probe.py dense */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_crash(int sig, siginfo_t *info, void *context) {
  (void)context;
  void *frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "signal %d at address %p; native stack:\n", sig, info->si_addr);
  for (int i = 0; i < n; i++) {
    Dl_info where;
    if (dladdr(frames[i], &where) && where.dli_fname)
      fprintf(stderr, "  #%d %s (%s+0x%lx)\n", i, where.dli_sname ? where.dli_sname : "?", where.dli_fname,
              (unsigned long)((char *)frames[i] - (char *)where.dli_fbase));
    else
      fprintf(stderr, "  #%d %p\n", i, frames[i]);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_crash;
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, NULL);
  sigaction(SIGABRT, &action, NULL);
  sigaction(SIGBUS, &action, NULL);
}
