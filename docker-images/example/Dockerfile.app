ARG PARENT
FROM ${PARENT}
ARG GREETING_VERSION
COPY app/ /opt/app/
RUN python3 -m compileall -q /opt/app && echo "${GREETING_VERSION}" > /opt/app/VERSION
