# The worker daemon. Its control plane needs no LibTorch; the model code in
# worker/model does (and joins the daemon with the distributed runtime).
add_library(detour_worker_lib STATIC
  ${CMAKE_CURRENT_LIST_DIR}/control_client.cc
  ${CMAKE_CURRENT_LIST_DIR}/worker.cc
)
add_library(detour::worker ALIAS detour_worker_lib)
target_link_libraries(detour_worker_lib
  PUBLIC detour::common detour::net detour::metrics detour::metrics_http detour::metrics_grpc
         absl::synchronization absl::time
  PRIVATE detour_warnings)

add_executable(detour-worker ${CMAKE_CURRENT_LIST_DIR}/main.cc)
target_link_libraries(detour-worker PRIVATE detour::worker detour_warnings)
