//! The device-plugin front end: kubelet's device plugin API, registration,
//! the DevicePlugin service, and who holds which device (kubelet's checkpoint
//! and pod-resources, through `kubelet::podresources`). It translates between
//! kubelet's wire format and the layers below.

pub mod api;
pub mod checkpoint;
pub mod holders;
pub mod kubelet;
pub mod list;
pub mod plugin;
pub mod service;
