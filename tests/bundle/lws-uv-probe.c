/* Creates a libwebsockets context on a foreign libuv loop, the way sandboxer-init serves, and
 * exits 0 only if that worked. Debian's libwebsockets loads its libuv glue as a plugin
 * (libwebsockets-evlib_uv.so) with dlopen at this point, so the probe fails when a bundle or an
 * image lacks it. Used by tests/bundle/test-bundle. */
#include <libwebsockets.h>
#include <stdio.h>
#include <string.h>
#include <uv.h>

int main(void) {
  uv_loop_t loop;
  if (uv_loop_init(&loop) != 0) return 2;
  void* foreign_loops[] = {&loop};
  struct lws_context_creation_info info;
  memset(&info, 0, sizeof info);
  info.port = CONTEXT_PORT_NO_LISTEN;
  info.options = LWS_SERVER_OPTION_LIBUV;
  info.foreign_loops = foreign_loops;
  lws_set_log_level(LLL_ERR | LLL_WARN, NULL);
  struct lws_context* ctx = lws_create_context(&info);
  if (!ctx) {
    fprintf(stderr, "lws-uv-probe: lws_create_context with LWS_SERVER_OPTION_LIBUV failed\n");
    return 1;
  }
  printf("lws-uv-probe: libwebsockets %s on libuv %s: ok\n", lws_get_library_version(), uv_version_string());
  lws_context_destroy(ctx);
  /* A foreign loop is closed by its owner after lws has let go of its handles. */
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  return 0;
}
