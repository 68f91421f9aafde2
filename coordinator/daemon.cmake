# The coordinator library and daemon. No LibTorch here, by design.
add_library(detour_coordinator_lib STATIC
  ${CMAKE_CURRENT_LIST_DIR}/client_auth.cc
  ${CMAKE_CURRENT_LIST_DIR}/control_service.cc
  ${CMAKE_CURRENT_LIST_DIR}/coordinator.cc
  ${CMAKE_CURRENT_LIST_DIR}/file_job_backend.cc
  ${CMAKE_CURRENT_LIST_DIR}/iteration_round.cc
  ${CMAKE_CURRENT_LIST_DIR}/job_manager.cc
  ${CMAKE_CURRENT_LIST_DIR}/job_metrics.cc
  ${CMAKE_CURRENT_LIST_DIR}/job_runner.cc
  ${CMAKE_CURRENT_LIST_DIR}/job_service.cc
  ${CMAKE_CURRENT_LIST_DIR}/job_store.cc
  ${CMAKE_CURRENT_LIST_DIR}/leader_gate.cc
  ${CMAKE_CURRENT_LIST_DIR}/link_matrix.cc
  ${CMAKE_CURRENT_LIST_DIR}/metered_job_backend.cc
  ${CMAKE_CURRENT_LIST_DIR}/pending_reason.cc
  ${CMAKE_CURRENT_LIST_DIR}/reattach_point.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_checkpoints.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_elastic.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_iteration.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_link.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_links.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_membership.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_part.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_planner.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_reattach.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_record.cc
  ${CMAKE_CURRENT_LIST_DIR}/runner_stage_loss.cc
  ${CMAKE_CURRENT_LIST_DIR}/service_discovery.cc
  ${CMAKE_CURRENT_LIST_DIR}/stage_reassignment.cc
  ${CMAKE_CURRENT_LIST_DIR}/stragglers.cc
  ${CMAKE_CURRENT_LIST_DIR}/timing_estimates.cc
  ${CMAKE_CURRENT_LIST_DIR}/worker_registry.cc
)
add_library(detour::coordinator ALIAS detour_coordinator_lib)
target_link_libraries(detour_coordinator_lib
  PUBLIC detour::common detour::net detour::metrics detour::metrics_http detour::metrics_grpc
         detour::planner detour::sim detour::etcd
         absl::synchronization absl::time
  PRIVATE detour_warnings)

add_executable(detour-coordinator ${CMAKE_CURRENT_LIST_DIR}/main.cc)
target_link_libraries(detour-coordinator PRIVATE detour::coordinator detour_warnings)
detour_tsan_support(detour-coordinator)
install(TARGETS detour-coordinator RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
