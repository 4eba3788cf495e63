# write_if_changed(FILE TEXT): writes TEXT to FILE only when FILE does not hold it already, so a
# generated source that did not change is not recompiled. Included by the embed-*.cmake scripts.
function(write_if_changed file text)
  set(old "")
  if(EXISTS ${file})
    file(READ ${file} old)
  endif()
  if(NOT "${old}" STREQUAL "${text}")
    file(WRITE ${file} "${text}")
  endif()
endfunction()
